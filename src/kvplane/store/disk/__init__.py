"""The SSD tier of a segment node: on-disk layout, the local store, and its duties."""
