"""The workers a coordinator uses: the fleet of actors (``fleet``), a shared pool's named actors
and credentials (``shared``) and the ``pdserve workers`` command that starts one (``command``)."""
