// Command lwepp-ask asks an endpoint picker the way a gateway does: Envoy's ext_proc over gRPC, the headers of
// one request with end of stream, and prints the endpoint the picker sets in x-gateway-destination-endpoint, one
// line per request (tests/e2e/test_gateway.py asks GAIE's lwepp for a model's pool). Built by hack/cluster.sh.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"os"
	"time"

	configPb "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extProcPb "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	// The picker whose protocol this speaks, pinned at the version hack/cluster.sh builds.
	_ "sigs.k8s.io/gateway-api-inference-extension/pkg/lwepp/metadata"
)

const destination = "x-gateway-destination-endpoint" // GAIE's pkg/lwepp/metadata.DestinationEndpointKey

func ask(client extProcPb.ExternalProcessorClient, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	headers := []*configPb.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "content-type", RawValue: []byte("application/json")},
	}
	err = stream.Send(&extProcPb.ProcessingRequest{Request: &extProcPb.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extProcPb.HttpHeaders{Headers: &configPb.HeaderMap{Headers: headers}, EndOfStream: true}}})
	if err != nil {
		return "", err
	}
	resp, err := stream.Recv()
	if err != nil {
		return "", err
	}
	_ = stream.CloseSend()
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == destination {
			return string(h.GetHeader().GetRawValue()), nil
		}
	}
	return "", fmt.Errorf("no %s in the answer: %v", destination, resp)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext_proc gRPC address")
	useTLS := flag.Bool("tls", true, "TLS without verification (lwepp serves a self-signed certificate by default)")
	n := flag.Int("n", 1, "requests to ask about")
	timeout := flag.Duration("timeout", 10*time.Second, "per request")
	flag.Parse()
	creds := insecure.NewCredentials()
	if *useTLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // a test client
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	client := extProcPb.NewExternalProcessorClient(conn)
	for i := 0; i < *n; i++ {
		endpoint, err := ask(client, *timeout)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fmt.Println(endpoint)
	}
}
