"""Listeners, remote pdb and park/resume: the debugger itself."""
