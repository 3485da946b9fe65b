"""Protocols: the order of work and synchronisation of dispatch and combine.

    routing -> layout -> schedule -> [protocol] -> engine -> transport

One package per protocol, each whole: its memory declared once (`blocks`), its
statement in torch (`exchange`), its numba and Triton halves with their drivers,
its status codes and their exceptions. `ubep` (no barrier, data as flag) and
`bsp` (the barrier-phased baseline) are normal mode's, and share `combine` (the
combine, and their drivers' base); `ll` is low-latency mode. All run over any
one-sided heap, inside one host: their forms across hosts live in `ubep.across`.

Shared here: `base` (the exchange interface, sizing, send plan), `halves` and
`device_halves` (entering numba halves, launching Triton ones), `warmup` (every
compiled half once before the ranks meet) and `local` (normal mode for a group
of one).
"""
