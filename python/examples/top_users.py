# %% [markdown]
# # The most retweeted users, on the GPU when there is one
#
# A notebook-style example (cells marked `# %%`, as Jupyter, VS Code and jupytext read them):
# generate the benchmark's tweets, ask for the users with the most retweets, plot them.
# Run it as a script to write the plot to `top_users.png` (or `$TOP_USERS_PNG`).

# %%
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import datafusion_gpu_topk as gt

ctx = gt.SessionContext()
ctx.register_tweets(1_000_000)
print("GPU:", gt.gpu_status())

# %%
top = ctx.sql(
    """
    SELECT uid, sum(retweet_count) AS retweets, count(*) AS tweets
    FROM tweets
    GROUP BY uid
    ORDER BY retweets DESC, uid
    LIMIT 15
    """
)
print(top.explain().splitlines()[-1])
users = top.to_pandas()
users

# %%
fig, ax = plt.subplots(figsize=(8, 4))
ax.barh([str(u) for u in users["uid"]][::-1], users["retweets"][::-1])
ax.set_xlabel("retweets")
ax.set_ylabel("user")
ax.set_title("Top 15 users by retweets")
fig.tight_layout()
fig.savefig(os.environ.get("TOP_USERS_PNG", "top_users.png"), dpi=100)
