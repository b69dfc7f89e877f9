"""Serving the trained weights: the publisher, the weight pushers, verl's replicas and the gateway drain."""
