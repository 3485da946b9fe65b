"""Collectives: protocol bsp across hosts, written as torch.distributed all-to-alls.

    protocol bsp (order of work) -> [collectives: all-to-alls under a deadline] -> gloo / NCCL

The bulk-synchronous baseline that protocol ubep's fabric path is measured against: the
flat all-to-all (`bsp_flat`), the hierarchical exchange that crosses between nodes once per
token over a rail and fans out over a node's shared heap (`bsp_hier`), and low-latency mode
over all-to-alls (`ll_flat`). Each collective and each wait for one runs under
`ubep.deadlines.collective_deadline`.
"""
