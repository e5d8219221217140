"""Modules the sandbox template process imports by file location (standard library only); see
../template.py. Not imported as part of rstar2_core."""
