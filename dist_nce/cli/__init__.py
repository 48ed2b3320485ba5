"""The command-line jobs, one module each, run as ``python -m dist_nce.cli.<job>``, as the
``dist-nce-<job>`` console scripts (setup.py), or through the thin ``jobs/<job>.py`` wrappers
that ``ray job submit --working-dir . -- python jobs/<job>.py`` names.

The top layer of the package (``.importlinter``): nothing below imports it. Modules that
share the config-driven start (``--config/--set/--dry-run/--help-config``) take it from
:mod:`dist_nce.cli.common`.
"""
