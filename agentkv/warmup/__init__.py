"""Background anchor warm-up coordinator."""
