"""Transports: where memory lives, how peers are reached and waited for.

    routing -> layout -> schedule -> protocol -> engine -> [transport]

`base` is the interface, `heap` its implementation over addressable memory,
`shm` a host's shared segments, `virtual` R ranks as threads of one process.
"""
