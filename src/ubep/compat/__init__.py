"""Drop-in layers for code written against other EP libraries (`ubep.compat.deep_ep`)."""
