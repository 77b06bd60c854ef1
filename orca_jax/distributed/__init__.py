"""Distribution over devices: the mesh, the logical axis rules and the parameter shardings.
A layer of its own, below models, because the model layers name their weights' logical axes
and the loaders and the worker place arrays by the same rules."""
