// Command fakegpu is a device plugin for the local real node (hack/node/node.sh): it advertises N devices of a
// resource (nvidia.com/gpu) to the kubelet over the device plugin API (v1beta1), as NVIDIA's device plugin does,
// and gives a container each device it is allocated as /dev/nvidia<i>, a bind of a harmless host character
// device (/dev/null by default). So an engine pod on the node is scheduled on, and sees, GPUs the way it would on
// a GPU node, under the kubelet's own allocation, and the engine's preflight counts them; nothing can compute on
// them: the engine in those pods is the simulator (hack/node/README.md).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices  []*pluginapi.Device
	hostPath string
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices once, all healthy, and holds the stream open: the kubelet takes a closed
// stream for a plugin gone.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// Allocate maps each allocated device "gpu-<i>" to /dev/nvidia<i> in the container, as NVIDIA's plugin keeps
// the host's numbering, and names them in NVIDIA_VISIBLE_DEVICES as it does.
func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		r := &pluginapi.ContainerAllocateResponse{Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")}}
		for _, id := range c.DevicesIds {
			r.Devices = append(r.Devices, &pluginapi.DeviceSpec{
				ContainerPath: "/dev/nvidia" + strings.TrimPrefix(id, "gpu-"), HostPath: p.hostPath, Permissions: "rw",
			})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, r)
	}
	log.Printf("allocated %v", req.ContainerRequests)
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource advertised")
	count := flag.Int("count", 4, "how many devices")
	hostPath := flag.String("host-path", "/dev/null", "the host character device each device is a bind of")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device plugin directory (its kubelet.sock)")
	endpoint := flag.String("endpoint", "disagg-fakegpu.sock", "this plugin's socket, in --dir")
	flag.Parse()
	if st, err := os.Stat(*hostPath); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		log.Fatalf("--host-path %s must be a character device (%v)", *hostPath, err)
	}
	p := &plugin{hostPath: *hostPath}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: pluginapi.Healthy})
	}

	sock := filepath.Join(*dir, *endpoint)
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listen %s: %v", sock, err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()

	conn, err := grpc.NewClient("unix://"+filepath.Join(*dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("kubelet socket: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: *endpoint, ResourceName: *resource,
	})
	cancel()
	_ = conn.Close()
	if err != nil {
		log.Fatalf("register %s with the kubelet: %v", *resource, err)
	}
	log.Printf("registered %d x %s (%s as /dev/nvidia<i>) at %s", *count, *resource, *hostPath, sock)

	// The kubelet removes every plugin socket when it restarts: then this plugin is gone for it, and exits.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-sig:
			srv.Stop()
			_ = os.Remove(sock)
			return
		case <-tick.C:
			if _, err := os.Stat(sock); err != nil {
				srv.Stop()
				log.Fatalf("%s removed (the kubelet restarted?): exiting", sock)
			}
		}
	}
}
