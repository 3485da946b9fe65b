"""DeepEP's Python API on top of ubep: `from ubep.compat import deep_ep` in place of `import deep_ep`,
or `ubep.compat.install_as_deep_ep()` so unchanged code importing `deep_ep` runs on ubep.

Provided: V1's `Buffer` and `Config`, V2's `ElasticBuffer` and `EPHandle`, `EventOverlap`,
`EventHandle`, `topk_idx_t`, and the `deep_ep.utils` module (`EventOverlap`, `EventHandle`).
"""

import torch

from ubep.compat.deep_ep import utils
from ubep.compat.deep_ep.buffer import Buffer, Config
from ubep.compat.deep_ep.elastic import ElasticBuffer
from ubep.compat.deep_ep.elastic_handle import EPHandle
from ubep.compat.deep_ep.utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's top-k index dtype
__version__ = "ubep"

__all__ = [
    "Buffer",
    "Config",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "topk_idx_t",
    "utils",
]
