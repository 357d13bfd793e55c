//go:build tools

// Package tools pins the etcd command built by hack/cluster.sh.
package tools

import _ "go.etcd.io/etcd/server/v3"
