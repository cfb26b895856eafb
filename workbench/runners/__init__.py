"""One interface, many backends: each runner maps named numpy inputs to named numpy outputs."""
