"""The superpod simulator: the library's plans executed on a topology model.

`engine` is the fabric model (messages through shared FIFO stages); `protocols`
turns a workload into the message patterns of ubep, bsp and deepep-ll and times
them; `run` is the user-facing entry (`simulate`); `calibrate` fits the free
parameters on published numbers; `cli` is `ubep simulate`.
"""
