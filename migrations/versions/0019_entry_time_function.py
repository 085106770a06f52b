"""entry_time_function: PostgreSQL reads an entry time with one function, sessionstore_entry_us

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27 13:30:00

An entry time (the payload's own `timestamp`: core.query.entry_time has the definition) was
one large SQL expression on PostgreSQL, five derived tables deep, written into every query
that used it: stats()'s usage query was 32 KB of SQL, which SQLAlchemy walked for its cache
key, psycopg re-split and PostgreSQL planned on every call. It is now this PL/pgSQL function,
the counterpart of the Python function SQLite registers (core.entry_clock.entry_us_of), and
a query says `sessionstore_entry_us(events.payload)`. Per row it takes about 4 us against
the expression's 6.5 (200,000 mixed rows: 0.74-0.88 s against 1.23-1.43 s), and it gives
the same value on every row (tests/contract/test_entry_time.py holds both backends to one
independent reading).

SQLite: nothing; its function is registered on each connection.
"""
from collections.abc import Sequence

from alembic import op


revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The definition (core.query.entry_time) step by step. A JSON number is epoch milliseconds:
# an integer exactly, any other number as a double, times 1000, floored; a non-integer
# literal over 40 characters or with a 4-digit exponent is none (a numeric's cast would
# fail past its range, a double's too). A string has the form of the regular expression
# (ASCII digits, upper-case T and Z), its fields are read by their places and checked
# against their ranges (a real day of the proleptic Gregorian calendar) before make_date
# numbers the day. The instant lies in the years 0001-9999 UTC. Nothing raises: the casts
# run only on text the checks before them admitted. No % in it: the driver reads none.
ENTRY_US = r"""
CREATE FUNCTION sessionstore_entry_us(payload json) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
DECLARE
    v json := json_extract_path(payload, 'timestamp');
    t text;
    n integer;
    zone integer;
    rest integer;
    y integer; mo integer; d integer; h integer; mi integer;
    s integer := 0;
    micro bigint := 0;
    zone_sign integer := 1;
    zone_hours integer := 0;
    zone_minutes integer := 0;
    exact numeric;
    micros double precision;
    us bigint;
    month_days integer;
BEGIN
    IF v IS NULL THEN
        RETURN NULL;
    END IF;
    t := v #>> '{}';
    CASE json_typeof(v)
    WHEN 'number' THEN
        IF ltrim(t, '-') ~ '^[0-9]+$' THEN
            IF length(t) > 17 OR t::bigint NOT BETWEEN -62135596800000 AND 253402300799999 THEN
                RETURN NULL;
            END IF;
            RETURN t::bigint * 1000;
        END IF;
        IF length(t) > 40 OR t ~ '[eE][+-]?[0-9]{4}' THEN
            RETURN NULL;
        END IF;
        exact := t::numeric;
        IF abs(exact) < 1e-300 THEN
            RETURN CASE WHEN exact < -2.4703282292062328e-324 THEN -1 ELSE 0 END;
        END IF;
        IF abs(exact) >= 1e300 THEN
            RETURN NULL;
        END IF;
        micros := floor(exact::double precision * 1000.0);
        -- bounds a double holds exactly (MAX_US is not one: as a double it is MAX_US + 1)
        IF micros >= -62135596800000000::double precision
           AND micros < 253402300800000000::double precision THEN
            RETURN micros::bigint;
        END IF;
        RETURN NULL;
    WHEN 'string' THEN
        IF t !~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]+)?)?(?:Z|[+-][0-9]{2}(?::?[0-9]{2})?)?$' THEN
            RETURN NULL;
        END IF;
        n := length(t);
        zone := CASE
            WHEN substr(t, n, 1) = 'Z' THEN 1
            WHEN substr(t, n - 5, 1) IN ('+', '-') THEN 6
            WHEN substr(t, n - 4, 1) IN ('+', '-') THEN 5
            WHEN substr(t, n - 2, 1) IN ('+', '-') THEN 3
            ELSE 0
        END;
        rest := n - 16 - zone;
        y := substr(t, 1, 4)::integer;
        mo := substr(t, 6, 2)::integer;
        d := substr(t, 9, 2)::integer;
        h := substr(t, 12, 2)::integer;
        mi := substr(t, 15, 2)::integer;
        IF rest >= 3 THEN
            s := substr(t, 18, 2)::integer;
        END IF;
        IF rest >= 5 THEN
            micro := substr(substr(t, 21, rest - 4) || '000000', 1, 6)::bigint;
        END IF;
        IF substr(t, n - zone + 1, 1) = '-' THEN
            zone_sign := -1;
        END IF;
        IF zone >= 3 THEN
            zone_hours := substr(t, n - zone + 2, 2)::integer;
        END IF;
        IF zone >= 5 THEN
            zone_minutes := substr(t, n - 1, 2)::integer;
        END IF;
        month_days := CASE
            WHEN mo = 2 AND mod(y, 4) = 0 AND (mod(y, 100) <> 0 OR mod(y, 400) = 0) THEN 29
            WHEN mo = 2 THEN 28
            WHEN mo IN (4, 6, 9, 11) THEN 30
            ELSE 31
        END;
        IF y < 1 OR mo NOT BETWEEN 1 AND 12 OR d NOT BETWEEN 1 AND month_days OR h > 23
           OR mi > 59 OR s > 59 OR zone_hours > 23 OR zone_minutes > 59 THEN
            RETURN NULL;
        END IF;
        us := (make_date(y, mo, d) - date '1970-01-01')::bigint * 86400000000
            + h * 3600000000::bigint + mi * 60000000::bigint + s * 1000000::bigint + micro
            - zone_sign * (zone_hours * 3600000000::bigint + zone_minutes * 60000000::bigint);
        IF us BETWEEN -62135596800000000 AND 253402300799999999 THEN
            RETURN us;
        END IF;
        RETURN NULL;
    ELSE
        RETURN NULL;
    END CASE;
END
$fn$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # the driver's own execute: SQLAlchemy's text() would read "(?:Z" as a parameter
        op.get_bind().exec_driver_sql(ENTRY_US)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION sessionstore_entry_us(json)")
