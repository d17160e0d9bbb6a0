"""Alembic environment for the llmgw store. It only runs inside Store.open(), which hands
over a connection already in a transaction (and holding the migration lock)."""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "llmgw store migrations run from Store.open(), which supplies the "
        "connection; they are not meant for the alembic command line"
    )

context.configure(
    connection=connection,
    target_metadata=None,  # revisions are written by hand
    # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
