"""DeepEP's Python API on top of ubep: `from ubep.compat import deep_ep` in place of `import deep_ep`,
or `install_as_deep_ep()` (also importable from here) so unchanged code importing `deep_ep` runs on ubep.

Provided: V1's `Buffer` and `Config`, V2's `ElasticBuffer` and `EPHandle`, `EventOverlap`,
`EventHandle`, `topk_idx_t`, DeepEP 2.1's `get_physical_domain_size` and
`get_logical_domain_size`, and its module layout: `deep_ep.utils` (with `utils.event` and
`utils.envs`), `deep_ep.buffers.legacy`, `deep_ep.buffers.elastic` and
`deep_ep.buffers.xlayers` (whose `XLayerScheduler` refuses to be built). V1's module name
`deep_ep.buffer` works too.
"""

import torch

from ubep.compat import explain_deep_ep, install_as_deep_ep
from ubep.compat.deep_ep import buffers, utils
from ubep.compat.deep_ep.buffer import Buffer, Config
from ubep.compat.deep_ep.elastic import ElasticBuffer
from ubep.compat.deep_ep.elastic_handle import EPHandle
from ubep.compat.deep_ep.utils.envs import get_logical_domain_size, get_physical_domain_size
from ubep.compat.deep_ep.utils.event import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's top-k index dtype
__version__ = "ubep"

__all__ = [
    "Buffer",
    "Config",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "buffers",
    "explain_deep_ep",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "install_as_deep_ep",
    "topk_idx_t",
    "utils",
]
