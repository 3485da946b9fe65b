"""DeepEP 2.1's `deep_ep.buffers.legacy`: V1's `Buffer` and `Config` (`ubep.compat.deep_ep.buffer`)."""

from ubep.compat.deep_ep.buffer import Buffer, Config

__all__ = ["Buffer", "Config"]
