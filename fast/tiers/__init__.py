"""Tier plug-ins of the composed cache (fast/hybrid.py): a tier holds copies of the tree's data
somewhere other than the device and moves them back and forth.  ``host.py``: the host tier
(HiCache), its controller and the in-flight records.  The device tier is the tree itself."""
