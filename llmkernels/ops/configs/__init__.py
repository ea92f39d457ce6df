"""Launch configurations of the families that are one module each (the norm package holds its own,
``norm/configs.py``): frozen records, a default derived from the device model, the tuned cache's
key."""
