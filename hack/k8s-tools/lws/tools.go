//go:build tools

// Package tools pins the LeaderWorkerSet manager (sigs.k8s.io/lws/cmd) built by hack/cluster.sh.
package tools

import _ "sigs.k8s.io/lws/cmd"
