"""The plumbing that train.py and scripts/ import: settings, the command line, run directories,
checkpoints, files, several processes, the tasks."""
