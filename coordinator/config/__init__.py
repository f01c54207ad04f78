"""The coordinator's configuration: ``ms_coordinator.json``'s keys (``schema``), how they are read
(``loader``), the worker cluster they lay out (``cluster``) and the tables and chart values
generated from them (``docs``)."""
