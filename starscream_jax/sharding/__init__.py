"""Layouts and how they are applied: the one resolver (`rules`), the layouts as data (`layouts`), the helpers that
place parameters, weights at use and activations under the active layout (`apply`), and hierarchical collectives for
per-device code (`collectives`)."""
