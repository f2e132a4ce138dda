// Command etcd is the etcd server, built from the published
// go.etcd.io/etcd/server/v3 module. `go install go.etcd.io/etcd/v3@...` does
// not work because etcd's own go.mod uses replace directives, so this tiny main
// calls the same entry point as upstream's server binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
