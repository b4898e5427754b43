/* The waterfall of one request, drawn in the browser from figure JSON the server sends for a
 * key (callbacks.WATERFALL_ROUTE). Pointing at a request in the breakdown for a moment fetches
 * its figure ahead, so the click that follows draws at once: no round trip on the click path,
 * and no wait for Dash's callback chain either: a listener on the breakdown's plotly_click draws
 * the fetched figure, and the chain, which selects the request in the dropdown, leaves the drawn
 * waterfall as it is (Dash copies a callback's figure, so setting it again would draw it twice;
 * the graph's figure prop stays the one before, which nothing reads and the next selection
 * replaces).
 * Dash calls the functions below as clientside callbacks (callbacks.register).
 * bench/dashboard_render.py times a click. */
(function () {
    const BREAKDOWN = 'breakdown-graph', WATERFALL = 'waterfall-graph';  // ids.py
    const CACHED = 32;  // figures kept, the most recently used
    const REST_MS = 80;  // the pointer rests this long on a request before its figure is fetched
    const cache = new Map();  // key -> Promise of the figure JSON, oldest first
    let resting = null;
    let shown = null;  // the key of the request the waterfall shows

    function route() {
        const config = JSON.parse(document.getElementById('_dash-config').textContent);
        return config.requests_pathname_prefix + '_kvscope/waterfall?key=';
    }

    function figureOf(key) {
        let figure = cache.get(key);
        if (figure) {
            cache.delete(key);  // most recently used last
        } else {
            figure = fetch(route() + encodeURIComponent(key)).then(response => {
                if (!response.ok) {
                    throw new Error(`waterfall of ${key}: HTTP ${response.status}`);
                }
                return response.json();
            }).then(fig => {
                figure.value = fig;  // drawable at once from now on
                return fig;
            });
            figure.catch(() => cache.delete(key));  // a failed fetch is retried next time
        }
        cache.set(key, figure);
        while (cache.size > CACHED) {
            cache.delete(cache.keys().next().value);
        }
        return figure;
    }

    function keyOf(event) {  // the request a breakdown hover or click is on (its first component)
        const points = (event && event.points) || [];
        const hit = points.find(p => p.customdata);
        return hit ? hit.customdata[0] : null;
    }

    function plot(id) {  // the Plotly div inside a dcc.Graph, once it has drawn
        const gd = document.querySelector(`#${id} .js-plotly-plot`);
        return gd && gd._fullLayout ? gd : null;
    }

    function drawFetched(key) {  // the click's waterfall now, when its figure is already here
        const figure = cache.get(key), gd = plot(WATERFALL);
        if (figure && figure.value && gd) {
            // the layout copied as dcc.Graph does: Plotly writes ranges into the one it gets
            Plotly.react(gd, {data: figure.value.data,
                              layout: JSON.parse(JSON.stringify(figure.value.layout))});
            shown = key;
        }
    }

    function listen() {  // once per breakdown plot: it is there before anything is hovered
        const gd = plot(BREAKDOWN);
        if (gd && !gd.kvscopeClick) {
            gd.kvscopeClick = true;
            gd.on('plotly_click', click => {
                const key = keyOf(click);
                if (key) {
                    drawFetched(key);
                }
            });
        }
    }

    window.dash_clientside = Object.assign({}, window.dash_clientside, {
        kvscope: {
            // hoverData -> nothing: fetch the figure of the request the pointer rests on
            prefetch: function (hover) {
                listen();
                clearTimeout(resting);
                const key = keyOf(hover);
                if (key) {
                    resting = setTimeout(() => figureOf(key).catch(() => {}), REST_MS);
                }
                return window.dash_clientside.no_update;
            },
            // clickData -> the request dropdown's value
            clicked: function (click) {
                const key = keyOf(click);
                return key ? key : window.dash_clientside.no_update;
            },
            // the request dropdown's value -> the waterfall's figure
            waterfall: function (key) {
                if (key && key === shown) {
                    return window.dash_clientside.no_update;  // drawn by the click already
                }
                shown = key;
                return figureOf(key || '');
            },
        },
    });
})();
