"""Integrations of ubep with frameworks (import the one you use: `ubep.integrations.transformers`)."""
