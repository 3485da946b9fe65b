"""DeepEP 2.1's `deep_ep.buffers.elastic`: `ElasticBuffer` and `EPHandle` (`ubep.compat.deep_ep.elastic`)."""

from ubep.compat.deep_ep.elastic import ElasticBuffer
from ubep.compat.deep_ep.elastic_handle import EPHandle

__all__ = ["EPHandle", "ElasticBuffer"]
