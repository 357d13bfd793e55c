//go:build tools

// Package tools pins GAIE's lightweight endpoint picker (cmd/lwepp), built by hack/cluster.sh from this module.
package main

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp"
