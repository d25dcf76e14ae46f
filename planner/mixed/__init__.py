"""Planning for clusters of mixed GPU types: the search, its candidate layouts and their plan."""
