"""Across hosts: everything a call does once its rows leave the memory one host can address.

    protocol (ubep, ll) -> [across: strategy -> call header -> fabric engine] -> the wire
    protocol (bsp)      -> [across: collectives under a deadline]            -> gloo / NCCL

- `fabric/`: bytes to a rank on another host, as messages on pre-posted lanes (`fabric.base`),
  over an engine: ZeroMQ (`fabric.zmq`, the default where pyzmq is installed), gloo
  point-to-point (`fabric.gloo`, the default otherwise) or NIXL (`fabric.nixl`).
- `call_header`: the few words that open every message (call id, kind, counts): the data is
  its own flag across hosts too.
- The strategies of protocol ubep over the fabric: `ubep_flat` (every peer reached directly)
  and `ubep_hier` (a token crosses once per remote host, on a rail, then fans out over the
  host's shared heap); low-latency mode's: `ll_flat`.
- `collectives/`: the bulk-synchronous baseline across hosts, written as torch.distributed
  all-to-alls: `bsp_flat`, `bsp_hier`, and low-latency mode over them (`ll_flat`).

`ubep.protocols` holds what runs inside one host over any one-sided heap; nothing there
imports from here.
"""
