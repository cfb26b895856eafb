"""A fleet: Ray nodes that advertise their host kind, sweeps whose cells are measured on a node of each kind, and
what each kind deploys."""
