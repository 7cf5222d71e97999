"""The queueing data model (key names, wire formats, Lua scripts), batch
forming and the reaper. Never imports ``gateway`` or ``gpu``."""
