"""The lighthouse server: ``app`` (lifecycle and wiring: ``Lighthouse``, ``serve``), ``jobs`` (one job's live
state), ``edge`` (the membership decision applied: persist, publish), ``leadership`` (HA election, failover,
redirects), ``service`` (the gRPC handlers), ``status`` (the one status view of gRPC, HTTP and the page) and
``http`` (the HTTP side port)."""
