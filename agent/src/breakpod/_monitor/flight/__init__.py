"""The flight recorder: the last steps' per-module statistics kept on the device
(``recorder``) and read as a table whose first bad row is marked (``table``)."""
