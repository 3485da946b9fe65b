"""`ubep bench`: ubep side by side with what a user would otherwise pick, on this host."""
