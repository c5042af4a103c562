"""Tools beside the serving path: ``dsv4 validate`` (the production model against the reference).
They may import the reference; nothing on the serving path imports them."""
