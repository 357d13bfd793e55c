//go:build tools

// Package tools pins the kubelet and kube-proxy, built by hack/cluster.sh (DISAGG_REAL_NODE=1) for the
// opt-in real node (hack/node/), so that `go mod tidy` keeps their dependencies in go.sum.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
