"""What normal mode's two protocols, ubep and bsp, share: the combine (pull and reduce) in every form,
and the base of their compiled drivers.

The combine's memory (`blocks`): per rank, its output rows in the order its dispatch
received them, their weights, and a `back` header (dtype, top-k, where each home's
block starts, the dispatch's seq). A combine runs two halves:

    send    an expert rank writes its output rows once, into its own memory; stamp BACK
    reduce  a home waits for every live expert rank's BACK, checks them all, then pulls its block
            from each and sums each token's rows in float32, ranks ascending, rounding once

ubep runs them as they are; bsp between barriers. Three forms keep the same
memory word for word: the torch statement (`torch_halves`), the numba halves
(`numba_halves`; `numba_driver` also holds what every normal-mode compiled driver
shares) and the Triton halves (`triton_halves`, `triton_driver`). `codes` and
`status` are the status codes every normal-mode half shares, and their exceptions.
"""
