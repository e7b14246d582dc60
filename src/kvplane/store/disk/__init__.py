"""The SSD tier's files: the on-disk layout and the local store (the node that runs them is
``kvplane.store.host.disk_node``)."""
