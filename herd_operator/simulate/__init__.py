"""`herd-operator simulate`: the policies and the allocator on a virtual cluster."""
