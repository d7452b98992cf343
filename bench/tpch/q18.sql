-- Source: apache/datafusion benchmarks/queries/q18.sql (DataFusion's TPC-H texts).
-- Unchanged (dates are strings in Shoal: DataFusion casts a Utf8 column compared with a
-- DATE literal to Date32, and extract() casts it to a timestamp, so no CAST is needed).
-- SQLBench-H query 18 derived from TPC-H query 18 under the terms of the TPC Fair Use Policy.
-- TPC-H queries are Copyright 1993-2022 Transaction Processing Performance Council.
select
	c_name,
	c_custkey,
	o_orderkey,
	o_orderdate,
	o_totalprice,
	sum(l_quantity)
from
	customer,
	orders,
	lineitem
where
	o_orderkey in (
		select
			l_orderkey
		from
			lineitem
		group by
			l_orderkey having
				sum(l_quantity) > 313
	)
	and c_custkey = o_custkey
	and o_orderkey = l_orderkey
group by
	c_name,
	c_custkey,
	o_orderkey,
	o_orderdate,
	o_totalprice
order by
	o_totalprice desc,
	o_orderdate limit 100;
