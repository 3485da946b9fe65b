"""Collectives: the protocols written as torch.distributed collectives, beside the addressable memory.

    protocol (order of work) -> [collectives: all-to-alls under a deadline] -> gloo / NCCL

Where peers' memory cannot be addressed (across hosts, or a transport asked for),
dispatch and combine run as collectives with their own floor: the flat BSP
all-to-all (`bsp_dist`), low-latency mode over all-to-alls (`ll_dist`), the call
header that opens every call half on them (`call_header`), and the hierarchical
exchange that crosses between nodes once per token over a rail and fans out over
a node's shared heap (`hier`). Each collective and each wait for one runs under
`ubep.deadlines.collective_deadline`.
"""
