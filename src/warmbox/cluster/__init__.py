"""A warmbox cluster: one engine per node, Ray for membership and liveness, a shared registry, a router."""
