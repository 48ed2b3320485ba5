"""Ray as a process sees it: runtime workarounds, the local head, the reaper, whether the actors fit."""
