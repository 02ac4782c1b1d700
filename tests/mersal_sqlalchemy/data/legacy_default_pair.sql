-- What `mersal db upgrade --sql` printed for PostgreSQL before the version table
-- was keyed on the pair of tables (commit 433034a): a database that release migrated.
BEGIN;

CREATE TABLE mersal_outbox_alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT mersal_outbox_alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> mersal_0001

CREATE TABLE mersal_outbox (
    id BIGSERIAL NOT NULL, 
    app VARCHAR(200) NOT NULL, 
    address TEXT NOT NULL, 
    publish BOOLEAN NOT NULL, 
    headers TEXT NOT NULL, 
    body BYTEA NOT NULL, 
    created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
    lease_until TIMESTAMP WITH TIME ZONE, 
    attempts INTEGER DEFAULT 0 NOT NULL, 
    parked_reason TEXT, 
    parked_at TIMESTAMP WITH TIME ZONE, 
    PRIMARY KEY (id)
);

CREATE INDEX ix_mersal_outbox_claim ON mersal_outbox (app, id) WHERE parked_at IS NULL;

CREATE TABLE mersal_inbox (
    app VARCHAR(200) NOT NULL, 
    message_id VARCHAR(255) NOT NULL, 
    handled_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
    PRIMARY KEY (app, message_id)
);

CREATE INDEX ix_mersal_inbox_handled_at ON mersal_inbox (handled_at);

INSERT INTO mersal_outbox_alembic_version (version_num) VALUES ('mersal_0001') RETURNING mersal_outbox_alembic_version.version_num;

COMMIT;

