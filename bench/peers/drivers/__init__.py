"""One driver per system; each runs in its own process (and, for the peers, virtualenv)."""
