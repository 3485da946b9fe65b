"""DeepEP's `deep_ep.utils`: V1's module (`EventOverlap`, `EventHandle`) and V2's package
(`deep_ep.utils.event`; `deep_ep.utils.envs` with the domain sizes)."""

from ubep.compat.deep_ep.utils import envs, event
from ubep.compat.deep_ep.utils.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "envs", "event"]
