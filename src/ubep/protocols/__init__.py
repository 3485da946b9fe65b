"""Protocols: the order of work and synchronisation of dispatch and combine.

    routing -> layout -> schedule -> [protocol] -> engine -> transport

`ubep` (no barrier, data as flag) and `bsp` (the barrier-phased baseline) run
over any one-sided transport; `ll` is low-latency mode over the same;
`bsp_dist`, `ll_dist` and the crossings of `hier` are the collective paths
between hosts; `local` and `ll_local` serve a group of one.
"""
