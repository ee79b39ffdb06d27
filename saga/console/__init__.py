"""The operator's web console, ``sagaguard ui`` (the ``ui`` extra: Starlette, Jinja2, uvicorn).

It lives in the saga package because it reads the saga journal as well as the effect ledger (the
lowest layer that sees both; it needs nothing from the connectors). Its actions are the shared
operator API's (:mod:`sagaguard.idempotency.operator`, :mod:`sagaguard.saga.operator`), so each is
recorded in the audit trail under the console user's name.

::

    from sagaguard.saga.console.app import create_app
    from sagaguard.saga.console.settings import ConsoleSettings

    app = create_app(ConsoleSettings("sqlite:///sagaguard.db", token=TOKEN), store=s, journal=j, audit=a)
"""
