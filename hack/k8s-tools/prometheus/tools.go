//go:build tools

// Package tools pins the prometheus and promtool commands built by hack/cluster.sh.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
