"""fencegate adapters: the edge where an admitted effect meets a real downstream."""
