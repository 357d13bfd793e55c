//go:build tools

// Package tools pins BuildKit's daemon and client, built by hack/cluster.sh build: hack/images.sh builds the
// images/ Dockerfiles with them (no Docker needed).
package tools

import (
	_ "github.com/moby/buildkit/cmd/buildctl"
	_ "github.com/moby/buildkit/cmd/buildkitd"
)
